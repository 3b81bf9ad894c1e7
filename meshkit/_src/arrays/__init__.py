"""Host data to global arrays and back: prepare, agree, transfer, assemble; batches; gather."""
