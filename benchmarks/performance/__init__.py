"""Performance benchmarks of the library on its own: throughput, overhead, memory, weight sync, learning."""
