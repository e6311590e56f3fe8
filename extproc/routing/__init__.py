"""Routing: model name -> pool and served model, then pool -> endpoint."""
