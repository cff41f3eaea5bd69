"""The seeded chaos soak of docs/reliability.md: ``python -m scripts.chaos --minutes 1 --seed 1`` (README.md)."""
