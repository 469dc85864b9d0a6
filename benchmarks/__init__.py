"""kvobs benchmarks: each compares kvobs against its baseline in the same run (see docs/performance.md)."""
