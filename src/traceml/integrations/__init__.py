"""Trainer integrations: huggingface.py (Trainer, Accelerate) and lightning.py; each imports its
framework only when imported itself, never at `import traceml`."""
