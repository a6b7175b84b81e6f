"""Plain data every room shares: model shapes (`spec`), expert formats and their bytes (`quant`),
slot padding, hardware profiles (`hw`), the timeline of spans, checkpoint headers, the metrics
both engines report (`metrics`), errors and small helpers. Nothing here imports torch or simpy
at module level."""
