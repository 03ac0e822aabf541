"""Optim layer (``lightning_onebit/optim/``): OnebitAdam, OnebitLamb and ZeroOneAdam, ``freeze_step="auto"``,
param groups, argument validation, and the momentum buckets and their exchange."""
