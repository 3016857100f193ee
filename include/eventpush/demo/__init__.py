"""The end-to-end demo (``python -m eventpush.demo``), its HTML report and the loopback
receiver that the demo, the tests and the benchmarks push to."""
