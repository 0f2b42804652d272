"""Simulations: the real controller and loop on a discrete clock, with simulated engines and trainer."""
