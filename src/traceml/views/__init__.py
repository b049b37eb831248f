"""What users see: the live terminal and web dashboards, the summary card and final_summary.json, the HTML report."""
