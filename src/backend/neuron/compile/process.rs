//! Running neuronx-cc: scratch directories, the timeout, killing the process tree, and the
//! output tails errors quote.
//!
//! # Scratch directories, timeouts
//!
//! Each compile runs in `<cache_dir>/work/<key>.<pid>/`: on the cache's filesystem (neuronx-cc's
//! artifacts are large; `/tmp` is often a small tmpfs) and private to the lock holder. It holds
//! the input, `command.txt` (the command line, quoted for a POSIX shell, to rerun by hand),
//! `compiler-output.txt` (stdout and stderr, interleaved) and whatever neuronx-cc writes. It is
//! removed after a success and kept after a failure, so the error can point at the logs; the next
//! attempt at the same key removes it.
//!
//! A compiler that runs longer than [`CompilerConfig::timeout`] is killed, together with its
//! descendants (found through `/proc` on Linux: neuronx-cc is a Python driver that starts backend
//! processes). The wait itself is `wait-timeout`'s (it sleeps until SIGCHLD or the deadline
//! instead of polling). Rejected: putting each compiler in its own process group and killing the
//! group, because then a Ctrl-C in the terminal would no longer reach the compilers and they would
//! outlive deepinfer.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use wait_timeout::ChildExt;

use super::cache::CacheIo;
use super::{CompileJob, CompilerConfig};
use crate::error::{fmt_duration, CompileError};

/// How many lines of the compiler's output an error quotes.
const TAIL_LINES: usize = 40;

/// `--version` gets at most this long, whatever the compile timeout.
const VERSION_TIMEOUT: Duration = Duration::from_secs(300);

/// The output (stdout then stderr) of `cfg.program --version`, once it has exited successfully.
pub(super) fn version_output(cfg: &CompilerConfig, graphs: &str) -> Result<String, CompileError> {
    let failed = |status: String, output: String| CompileError::VersionFailed {
        program: cfg.program.clone(),
        graphs: graphs.to_string(),
        status,
        output,
    };
    let mut cmd = Command::new(program_path(&cfg.program));
    cmd.arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = spawn(&mut cmd).map_err(|source| CompileError::CompilerNotFound {
        program: cfg.program.clone(),
        graphs: graphs.to_string(),
        source,
    })?;
    // Read both pipes on threads so a chatty compiler cannot fill one and block.
    let readers: Vec<_> = [
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
        child
            .stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    ]
    .into_iter()
    .flatten()
    .map(|mut r| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf);
            buf
        })
    })
    .collect();
    let timeout = cfg.timeout.min(VERSION_TIMEOUT);
    let status = wait_or_kill(&mut child, timeout)
        .map_err(|e| failed(format!("cannot wait for it: {e}"), String::new()))?;
    let mut text = String::new();
    for r in readers {
        text.push_str(&String::from_utf8_lossy(&r.join().unwrap_or_default()));
    }
    let Some(status) = status else {
        return Err(failed(
            format!("timed out after {}", fmt_duration(timeout)),
            tail_lines(&text, TAIL_LINES),
        ));
    };
    if !status.success() {
        return Err(failed(status.to_string(), tail_lines(&text, TAIL_LINES)));
    }
    Ok(text)
}

/// Runs neuronx-cc on one graph in a fresh scratch directory; returns the NEFF bytes.
///
/// The caller holds `key`'s lock, so earlier attempts' scratch directories are its to remove.
pub(super) fn run_compiler(
    cfg: &CompilerConfig,
    job: &CompileJob,
    key: &str,
) -> Result<Vec<u8>, CompileError> {
    let io = |action: &'static str, path: &Path, e: io::Error| {
        CacheIo::new(action, path, e).into_error(&job.name)
    };
    let work_root = cfg.cache_dir.join("work");
    fs::create_dir_all(&work_root).map_err(|e| io("create", &work_root, e))?;
    // We hold the key's lock: earlier attempts' directories (kept for their logs) are ours.
    if let Ok(dir) = fs::read_dir(&work_root) {
        for e in dir.flatten() {
            if e.file_name()
                .to_string_lossy()
                .starts_with(&format!("{key}."))
            {
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }
    let workdir = work_root.join(format!("{key}.{}", std::process::id()));
    fs::create_dir_all(&workdir).map_err(|e| io("create", &workdir, e))?;
    let workdir = fs::canonicalize(&workdir).unwrap_or(workdir);

    let input = workdir.join("model.hlo.pb");
    let output = workdir.join("model.neff");
    let log = workdir.join("compiler-output.txt");
    fs::write(&input, &job.hlo).map_err(|e| io("write", &input, e))?;
    let args = cfg.command_args(&input, &output);
    let command = shell_command(&cfg.program, &args);
    let _ = fs::write(
        workdir.join("command.txt"),
        format!("cd {}\n{command}\n", quote(&workdir.to_string_lossy())),
    );
    let out_file = File::create(&log).map_err(|e| io("create", &log, e))?;
    let err_file = out_file.try_clone().map_err(|e| io("create", &log, e))?;

    let mut cmd = Command::new(program_path(&cfg.program));
    cmd.args(&args)
        .current_dir(&workdir)
        .stdin(Stdio::null())
        .stdout(out_file)
        .stderr(err_file);
    let mut child = spawn(&mut cmd).map_err(|source| CompileError::CompilerNotFound {
        program: cfg.program.clone(),
        graphs: job.name.clone(),
        source,
    })?;
    drop(cmd); // closes our copies of the log file handles
    let status = wait_or_kill(&mut child, cfg.timeout)
        .map_err(|e| io("wait for the compiler of", &workdir, e))?;
    // What this compile (or an earlier, larger one) took, for how many run at once next time.
    super::jobs::record_peak(&cfg.cache_dir);
    let tail = || output_tail(&log, &workdir.join("log-neuron-cc.txt"));
    let Some(status) = status else {
        return Err(CompileError::Timeout {
            graph: job.name.clone(),
            timeout: cfg.timeout,
            tail: tail(),
            workdir,
        });
    };
    if !status.success() {
        return Err(CompileError::CompilerFailed {
            graph: job.name.clone(),
            status: status.to_string(),
            command,
            tail: tail(),
            workdir,
        });
    }
    match fs::read(&output) {
        Ok(neff) if !neff.is_empty() => {
            let _ = fs::remove_dir_all(&workdir);
            Ok(neff)
        }
        _ => Err(CompileError::NoOutput {
            graph: job.name.clone(),
            path: output,
            tail: tail(),
        }),
    }
}

/// The compiler runs in a scratch directory, so a relative path with a directory part
/// (`tools/neuronx-cc`) is made absolute first; a bare name is still looked up on PATH.
fn program_path(program: &Path) -> PathBuf {
    if program.components().count() > 1 {
        std::path::absolute(program).unwrap_or_else(|_| program.to_path_buf())
    } else {
        program.to_path_buf()
    }
}

/// Spawns, retrying briefly on ETXTBSY: a compiler script that was just written (an install in
/// progress, or a test's fake) can be "busy" while another thread's fork still holds it open.
fn spawn(cmd: &mut Command) -> io::Result<Child> {
    let mut attempts = 0;
    loop {
        match cmd.spawn() {
            Err(e) if e.kind() == io::ErrorKind::ExecutableFileBusy && attempts < 20 => {
                attempts += 1;
                std::thread::sleep(Duration::from_millis(25));
            }
            other => return other,
        }
    }
}

/// Waits for `child` for at most `timeout`; on timeout kills it and its descendants and returns
/// `None`.
fn wait_or_kill(child: &mut Child, timeout: Duration) -> io::Result<Option<ExitStatus>> {
    let status = child.wait_timeout(timeout)?;
    if status.is_none() {
        kill_tree(child);
    }
    Ok(status)
}

/// Kills `child` and every process below it (best effort), then reaps `child`.
fn kill_tree(child: &mut Child) {
    let below = descendants(child.id());
    let _ = child.kill();
    if !below.is_empty() {
        // std can signal only its own children; `kill(1)` reaches the grandchildren.
        let _ = Command::new("kill")
            .arg("-KILL")
            .args(below.iter().map(u32::to_string))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
    let _ = child.wait();
}

/// The pids below `root`, from `/proc/<pid>/stat` (Linux; elsewhere none are found).
fn descendants(root: u32) -> Vec<u32> {
    let Ok(dir) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the
        // last ')'.
        let ppid = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().nth(1))
            .and_then(|s| s.parse::<u32>().ok());
        if let Some(ppid) = ppid {
            children.entry(ppid).or_default().push(pid);
        }
    }
    let mut found = Vec::new();
    let mut queue = VecDeque::from([root]);
    while let Some(p) = queue.pop_front() {
        for &c in children.get(&p).into_iter().flatten() {
            if !found.contains(&c) && c != root {
                found.push(c);
                queue.push_back(c);
            }
        }
    }
    found
}

/// The last lines of the compiler's captured output, or of its own log when it printed nothing.
fn output_tail(output: &Path, logfile: &Path) -> String {
    for path in [output, logfile] {
        let text = read_tail(path, 64 * 1024);
        if !text.trim().is_empty() {
            return tail_lines(&text, TAIL_LINES);
        }
    }
    "(the compiler printed nothing)".to_string()
}

/// The last `max` bytes of a file, lossily decoded; empty when unreadable.
fn read_tail(path: &Path, max: u64) -> String {
    let Ok(mut f) = File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map_or(0, |m| m.len());
    let mut buf = Vec::new();
    if f.seek(SeekFrom::Start(len.saturating_sub(max))).is_ok() {
        let _ = f.read_to_end(&mut buf);
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// The last `n` lines of `text`.
fn tail_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.trim_end().lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// `program args...` quoted for a POSIX shell, to show and to rerun by hand (non-UTF-8 parts
/// are shown lossily).
fn shell_command(program: &Path, args: &[OsString]) -> String {
    std::iter::once(program.as_os_str())
        .chain(args.iter().map(OsString::as_os_str))
        .map(|a| quote(&a.to_string_lossy()).into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// One word quoted for a POSIX shell (`shlex`). A word `shlex` refuses (one with a NUL byte,
/// which no argv element or path can hold anyway) is shown as is rather than failing the
/// compile over a message.
fn quote(word: &str) -> Cow<'_, str> {
    shlex::try_quote(word).unwrap_or(Cow::Borrowed(word))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tails_keep_the_last_lines() {
        let text: String = (1..=50).map(|i| format!("l{i}\n")).collect();
        let t = tail_lines(&text, 40);
        assert!(t.starts_with("l11\n") && t.ends_with("l50"));
        assert_eq!(tail_lines("one\n", 40), "one");
    }

    #[test]
    fn commands_are_quoted_for_a_shell() {
        let args: Vec<OsString> = ["compile", "a b'c", "--auto-cast=none", "$HOME", ""]
            .into_iter()
            .map(OsString::from)
            .collect();
        let cmd = shell_command(Path::new("/opt/neuronx-cc"), &args);
        assert!(cmd.starts_with("/opt/neuronx-cc compile "), "{cmd}");
        // A shell splits it back into exactly the argv that ran.
        let words = shlex::split(&cmd).unwrap();
        let want: Vec<String> = std::iter::once("/opt/neuronx-cc".to_string())
            .chain(args.iter().map(|a| a.to_string_lossy().into_owned()))
            .collect();
        assert_eq!(words, want);
    }

    #[test]
    fn plain_words_stay_unquoted() {
        assert_eq!(quote("/w/model.hlo.pb"), "/w/model.hlo.pb");
        assert_eq!(quote("-O1"), "-O1");
        assert_eq!(shlex::split(&quote("a b'c")).unwrap(), ["a b'c"]);
    }

    #[test]
    fn durations_read_as_seconds() {
        assert_eq!(fmt_duration(Duration::from_secs(600)), "600 s");
        assert_eq!(fmt_duration(Duration::from_millis(1500)), "1.5 s");
    }
}
