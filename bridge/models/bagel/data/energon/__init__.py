"""Energon side of the BAGEL pipeline: crude WebDataset layout, converter from the official raw formats, readers."""
