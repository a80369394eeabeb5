"""Measurements: step timing and throughput, NVML and host sampling, and the sinks they flow to."""
