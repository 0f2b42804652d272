"""The GPU smoke check (make gpu-smoke) and its checks; --cpu is a dry run on CPU."""
