"""BAGEL training-data pipeline for Megatron."""
