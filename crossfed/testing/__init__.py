"""Stand-ins for what tests and benchmarks cannot have on one machine, each named as such."""
