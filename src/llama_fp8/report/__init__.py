"""The A/B report: loading runs (runs, logparse), summarising and judging them (compare), plots (plots)."""
