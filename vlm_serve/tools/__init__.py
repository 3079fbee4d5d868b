"""Tools around the server: the built-in model's scenes and training, and the GPU kit."""
