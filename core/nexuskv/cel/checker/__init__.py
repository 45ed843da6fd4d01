"""The CEL type checker: name resolution, type relations, type parameters, the cost bound."""
