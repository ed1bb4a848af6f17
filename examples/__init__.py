"""Example plug-ins (agent fns, reward fns) loaded by import path from recipes; run from the repo root."""
