"""What the tests share: processes and pools (distributed), random problems and float64 references
(reference), comparisons (checks), small Megatron-Core models and their comparisons (megatron), marks."""
