"""Pure analysis of stored records: steps rolled up across ranks and windows of them (rollup), each rank's wall time by part (goodput), the live views' state (live)."""
