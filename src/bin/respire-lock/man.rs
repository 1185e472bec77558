//! `respire-lock man`: manual pages made from the clap definitions, so that
//! they say what `--help` says.

use std::io::Write;

use clap::CommandFactory as _;

use crate::args::Cli;

/// Writes the page of `subcommand` (`respire-lock-run(1)`...), or the tool's
/// (`respire-lock(1)`), as roff to `out`. The long help after the options
/// (modes, exit statuses, events) becomes a DETAILS section, kept as written.
pub(crate) fn render(subcommand: Option<&str>, out: &mut dyn Write) -> std::io::Result<()> {
    let mut tool = Cli::command().disable_help_subcommand(true);
    tool.build();
    let cmd = match subcommand {
        None => tool,
        Some(name) => tool
            .find_subcommand(name)
            .cloned()
            .ok_or_else(|| std::io::Error::other(format!("no subcommand {name}")))?
            .display_name(format!("respire-lock-{name}")),
    };
    let man = clap_mangen::Man::new(cmd.clone())
        .source(format!("respire-lock {}", env!("CARGO_PKG_VERSION")))
        .manual("respire-lock");
    man.render_title(out)?;
    man.render_name_section(out)?;
    man.render_synopsis_section(out)?;
    man.render_description_section(out)?;
    if cmd.get_arguments().any(|a| !a.is_hide_set()) {
        man.render_options_section(out)?;
    }
    if cmd.has_subcommands() {
        man.render_subcommands_section(out)?;
    }
    let details = cmd.get_after_long_help().or_else(|| cmd.get_after_help());
    if let Some(details) = details {
        writeln!(out, ".SH DETAILS\n.nf")?;
        for line in details.to_string().lines() {
            writeln!(out, "{}", roff_line(line))?;
        }
        writeln!(out, ".fi")?;
    }
    if cmd.get_version().is_some() {
        man.render_version_section(out)?;
    }
    Ok(())
}

/// `line` as literal roff text: backslashes escaped, and a leading `.` or
/// `'` kept from reading as a request.
fn roff_line(line: &str) -> String {
    let escaped = line.replace('\\', "\\e");
    if escaped.starts_with(['.', '\'']) {
        format!("\\&{escaped}")
    } else {
        escaped
    }
}
