"""What every part shares and nothing below it: config field checks, Markdown tables, the mesh and its sharding rules,
packed documents' ids, host memory, dispatch, a quiet start."""
