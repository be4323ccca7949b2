use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = visiongate::config::Config::parse();
    visiongate::telemetry::init();
    let settings = config.validate().map_err(anyhow::Error::msg)?;
    let shutdown = visiongate::shutdown::on_signals(settings.exit_timeout);
    visiongate::run(settings, shutdown).await
}
