"""Watching a job: per-rank step anatomy, straggler attribution, the records `phalanx top` and the
dashboard read. The worker side (anatomy, exchange) never imports the launcher side (top, dashboard),
and the launcher side never imports torch."""
