"""Regions that prove: input splitting (branch and bound) over boxes, VNN-LIB properties, and
the affine-ReLU chain domain that bounds the parts of a split (docs/regions.md)."""
