"""LoRA support: PEFT adapter loading and validation (adapter.py), the adapter registry and device
slots (manager.py), LoRA wrappers over the base linear layers (layers.py) and per-step token -> slot
mapping (punica.py). See DESIGN.md sections 5 and 6."""
