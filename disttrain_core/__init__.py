"""disttrain: disaggregated multimodal LLM training (docs/ARCHITECTURE.md shows its layers)."""
