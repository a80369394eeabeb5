"""Corpus to token files (train.bin, val.bin, meta.json) for data=memmap: reading and
tokenising in worker processes (corpus), writing atomically (build), the keys (schema).
May import data (its tokenizers) and checkpoint (atomic writes); the command is perfrun.commands.prepare."""
