"""CEL source text to a tree: the grammar, literal decoding, macros."""
