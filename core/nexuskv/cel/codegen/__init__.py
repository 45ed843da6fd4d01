"""Checked CEL trees to Python source: code generation and constant folding."""
