"""``llm-d-saturation``: placeholder, filled from the published control law."""
