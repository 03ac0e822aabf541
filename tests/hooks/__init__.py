"""Hook layer (``lightning_onebit/hooks/``): the overlapped exchange on plain DDP, without Lightning."""
