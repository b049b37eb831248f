"""What users see: the summary card and final_summary.json, the HTML report."""
