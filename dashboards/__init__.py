"""kvobs's Grafana dashboard and Prometheus rules, generated from code.

``python -m dashboards.generate`` writes ``dashboards/kvobs-offload.json`` and ``dashboards/rules/*.yaml``
from :mod:`dashboards.dashboard`, :mod:`dashboards.alerts` and :mod:`dashboards.recording`, with the values of
``dashboards/config.yaml``; ``--check`` says which checked-in file differs. Count and range queries come
from :mod:`dashboards.promql`, one place for the forms that stay right through restarts and scrape gaps.
"""
