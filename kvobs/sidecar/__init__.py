"""``kvobs serve``: reads the engines' journals, keeps the Prometheus registry, serves HTTP."""
