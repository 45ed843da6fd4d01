"""The request paths: read (plan), write (commit), load (materialize), route."""
