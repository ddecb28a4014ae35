"""Pictures of plans and measured steps: Gantt timelines with memory over time."""
