"""The fault soak, run by scripts/soak.sh (excluded from the default suite in pyproject.toml)."""
