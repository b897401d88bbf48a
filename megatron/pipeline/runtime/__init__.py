"""The tensor half of the pipeline library: stage workers, executors, transport, weight-version policies, B/W split and tracing. Needs torch."""
