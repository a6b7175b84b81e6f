"""Reading finished runs: run folders (`runfolder`) and predicted against measured (`validate`)."""
