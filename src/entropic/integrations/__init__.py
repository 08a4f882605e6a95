"""The control laws inside other engines' sampling loops (transformers' `generate()`)."""
