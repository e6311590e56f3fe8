"""Response cache: the pieces that decide what is worth looking up, storing and refusing early."""
