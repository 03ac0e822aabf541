"""Callback layer (``lightning_onebit/callbacks/``): MomentumMask, ErrorFeedbackCheckpoint, CommunicationMonitor and
its compression advice."""
