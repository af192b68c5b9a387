"""Preemption inside each worker: the signals it watches (signals.py), and the agreed stop step, its
checkpoint and exit (worker.py). The launcher's side is launch/preemption.py; the outcome line both
print is preemption_report.py."""
