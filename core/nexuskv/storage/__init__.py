"""Where state lives: the tier hierarchy, eviction, the bounded write queue, prefetch."""
