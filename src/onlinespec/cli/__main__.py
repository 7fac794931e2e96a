from onlinespec.cli import app

app()
