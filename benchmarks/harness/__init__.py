"""The shared harness: arguments, child processes, results and their envelope, figures, the registry."""
