"""The executor's loop: one task of one stage, its input, chunk commits and sink deliveries."""
