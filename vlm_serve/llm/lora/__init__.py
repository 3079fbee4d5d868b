"""LoRA adapters: their weights in slots beside the base layers, and which rows of a batch use which."""
