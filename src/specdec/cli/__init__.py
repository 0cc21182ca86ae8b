"""The ``specdec`` command line (a leaf: nothing in the core imports it)."""
