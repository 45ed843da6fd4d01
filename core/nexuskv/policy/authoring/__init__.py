"""Tools for policy authors: unit tests with coverage, explanations of a decision."""
