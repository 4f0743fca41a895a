"""Model definitions built only from engine.layers."""
