"""What generated CEL code runs on: values and errors, conversions, the standard library, dynamic dispatch."""
