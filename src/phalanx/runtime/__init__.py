"""Code that runs inside each worker: context, process group, collectives, watchdog, seeding, profiler."""
