//! The NEFF cache on disk: entries, their verified reads and atomic writes, and the per-key lock.
//!
//! # The cache entry
//!
//! `<cache_dir>/<key>/model.neff` and `<cache_dir>/<key>/meta.json` (graph name, key, size and
//! SHA-256 of the NEFF, compiler version, target, flags, creation time). Each file is written to a
//! temporary file in the same directory (`tempfile`), fsynced, then renamed over its final name;
//! `meta.json` is written last, so it is the commit record. A reader checks that the NEFF's size
//! and SHA-256 match `meta.json`; a truncated, partial or otherwise corrupt entry is reported as a
//! `tracing` warning (`NEFF cache entry <key> for <name> is corrupt (<why>); recompiling`) and
//! recompiled. A failed compile writes nothing into the cache. Rejected: libneuronxla's habit of
//! caching failures until `--retry_failed_compilation`; a timeout or an out-of-memory kill is
//! often transient, and retrying is the user's obvious next step.
//!
//! # Locking
//!
//! Two processes capturing the same model at once would compile every graph twice. So each key has
//! a lock file `<cache_dir>/<key>.lock`, locked exclusively with [`std::fs::File::lock`] while the
//! entry is checked, compiled and written; the second process waits, then finds the entry and
//! reuses it (its result says `cache_hit`). The lock is taken only after a lock-free lookup has
//! missed, so warm starts never wait on a compile of some other graph.
//!
//! The kernel drops the lock when its holder dies, so a crash or `kill -9` never leaves a stale
//! lock behind. Rejected: marker files created with `create_new` (libneuronxla's
//! `model.hlo_module.pb.lock`), which stay behind after a crash and block everyone until someone
//! deletes them by hand. Rejected: one lock for the whole cache, which would serialise unrelated
//! compiles across processes. Lock files are never deleted: deleting one while a process waits on
//! it would let a third process lock a fresh inode, and two processes would then hold "the" lock.
//! On a filesystem without file locks the driver warns and goes on unlocked; entries stay
//! consistent (writes are atomic), at worst a graph is compiled twice.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{CompileJob, CompilerConfig};
use crate::error::CompileError;

/// The NEFF's file name inside an entry.
pub(super) const NEFF_FILE: &str = "model.neff";
/// The commit record's file name inside an entry.
const META_FILE: &str = "meta.json";
/// What every temporary file's name contains (leftovers of a dead writer are found by it).
const TMP_MARK: &str = ".tmp.";

/// A filesystem operation on the cache (or a scratch directory under it) that failed; the
/// caller names the graph when it turns this into a [`CompileError::Cache`].
#[derive(Debug)]
pub(super) struct CacheIo {
    action: &'static str,
    path: PathBuf,
    source: io::Error,
}

impl CacheIo {
    /// `action` (`create`, `write`, `lock`, ...) on `path` failed with `source`.
    pub(super) fn new(action: &'static str, path: &Path, source: io::Error) -> Self {
        CacheIo {
            action,
            path: path.to_path_buf(),
            source,
        }
    }

    /// The error, for the graph being compiled.
    pub(super) fn into_error(self, graph: &str) -> CompileError {
        CompileError::Cache {
            graph: graph.to_string(),
            action: self.action,
            path: self.path,
            source: self.source,
        }
    }
}

/// The directory of `key`'s entry.
pub(super) fn entry_dir(cache_dir: &Path, key: &str) -> PathBuf {
    cache_dir.join(key)
}

/// `meta.json`: what the entry holds and how it was made.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Meta {
    /// The graph that first produced the entry (content-addressed: others may share it).
    name: String,
    key: String,
    size: u64,
    sha256: String,
    compiler_version: String,
    target: String,
    flags: Vec<String>,
    hlo_size: u64,
    hlo_sha256: String,
    created_unix_secs: u64,
    deepinfer_version: String,
}

impl Meta {
    /// The record of `neff`, compiled from `job` under `key` by compiler `version` with `cfg`.
    pub(super) fn new(
        job: &CompileJob,
        key: &str,
        neff: &[u8],
        version: &str,
        cfg: &CompilerConfig,
    ) -> Self {
        Meta {
            name: job.name.clone(),
            key: key.to_string(),
            size: neff.len() as u64,
            sha256: sha256_hex(neff),
            compiler_version: version.to_string(),
            target: cfg.target.clone(),
            flags: cfg.flags.clone(),
            hlo_size: job.hlo.len() as u64,
            hlo_sha256: sha256_hex(&job.hlo),
            created_unix_secs: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            deepinfer_version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }
}

/// A cache lookup's outcome.
pub(super) enum Lookup {
    /// The entry is complete and its NEFF matches `meta.json`.
    Hit(Vec<u8>),
    /// There is no entry.
    Missing,
    /// There is an entry, but it cannot be trusted (why).
    Corrupt(String),
}

/// Reads and verifies one entry.
pub(super) fn read_entry(entry: &Path, key: &str) -> Lookup {
    let meta_path = entry.join(META_FILE);
    let neff_path = entry.join(NEFF_FILE);
    let meta_bytes = match fs::read(&meta_path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return if neff_path.exists() {
                Lookup::Corrupt("model.neff without meta.json: a write was interrupted".into())
            } else {
                Lookup::Missing
            };
        }
        Err(e) => return Lookup::Corrupt(format!("cannot read meta.json: {e}")),
    };
    let meta: Meta = match serde_json::from_slice(&meta_bytes) {
        Ok(m) => m,
        Err(e) => return Lookup::Corrupt(format!("meta.json is not valid: {e}")),
    };
    if meta.key != key {
        return Lookup::Corrupt(format!("meta.json names key {}", meta.key));
    }
    let neff = match fs::read(&neff_path) {
        Ok(b) => b,
        Err(e) => return Lookup::Corrupt(format!("cannot read model.neff: {e}")),
    };
    if neff.len() as u64 != meta.size {
        return Lookup::Corrupt(format!(
            "model.neff is {} bytes, meta.json says {}",
            neff.len(),
            meta.size
        ));
    }
    if sha256_hex(&neff) != meta.sha256 {
        return Lookup::Corrupt("the SHA-256 of model.neff does not match meta.json".into());
    }
    Lookup::Hit(neff)
}

/// Removes a corrupt entry's files, `meta.json` first: without it the entry reads as missing,
/// never as valid. The caller holds the key's lock.
pub(super) fn remove_entry(entry: &Path) -> Result<(), CacheIo> {
    for file in [META_FILE, NEFF_FILE] {
        let path = entry.join(file);
        match fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Err(CacheIo::new("remove", &path, e))
            }
            _ => {}
        }
    }
    Ok(())
}

/// Writes `model.neff`, then `meta.json`, each atomically. The caller holds the key's lock.
pub(super) fn write_entry(entry: &Path, meta: &Meta, neff: &[u8]) -> Result<(), CacheIo> {
    fs::create_dir_all(entry).map_err(|e| CacheIo::new("create", entry, e))?;
    // Leftovers of a writer that died mid-write (we hold the lock: nobody else is writing).
    if let Ok(dir) = fs::read_dir(entry) {
        for e in dir.flatten() {
            if e.file_name().to_string_lossy().contains(TMP_MARK) {
                let _ = fs::remove_file(e.path());
            }
        }
    }
    let meta_path = entry.join(META_FILE);
    let meta_json = serde_json::to_vec_pretty(meta)
        .map_err(|e| CacheIo::new("write", &meta_path, io::Error::other(e)))?;
    for (file, bytes) in [(NEFF_FILE, neff), (META_FILE, &meta_json[..])] {
        write_atomic(entry, file, bytes)
            .map_err(|e| CacheIo::new("write", &entry.join(file), e))?;
    }
    // Make the renames durable; not every filesystem lets a directory be fsynced.
    if let Ok(dir) = File::open(entry) {
        let _ = dir.sync_all();
    }
    Ok(())
}

/// Writes `dir/name` through a temporary file in `dir` (`.<name>.tmp.<random>`): write, fsync,
/// rename. On failure the temporary file is removed (by `tempfile`'s drop).
fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}{TMP_MARK}"))
        .tempfile_in(dir)?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(dir.join(name)).map_err(|e| e.error)?;
    Ok(())
}

/// The hex SHA-256 of `bytes`, as `meta.json` records it.
fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// A key's lock, held until dropped (the kernel also drops it if the process dies).
pub(super) struct KeyLock {
    _file: File,
    locked: bool,
}

impl KeyLock {
    /// False when the filesystem has no file locks and the compile goes on unlocked.
    pub(super) fn is_locked(&self) -> bool {
        self.locked
    }
}

/// Locks `<cache_dir>/<key>.lock` exclusively, calling `on_wait` first if another process or
/// thread holds it. On a filesystem without file locks, returns an unlocked [`KeyLock`].
///
/// std's file locks (Rust 1.89+): no extra crate, and the kernel releases them if the process
/// dies mid-compile.
pub(super) fn lock_key(
    cache_dir: &Path,
    key: &str,
    on_wait: impl FnOnce(),
) -> Result<KeyLock, CacheIo> {
    let lock_path = cache_dir.join(format!("{key}.lock"));
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| CacheIo::new("open the lock file", &lock_path, e))?;
    let locked = match file.try_lock() {
        Ok(()) => true,
        Err(fs::TryLockError::WouldBlock) => {
            on_wait();
            file.lock()
                .map_err(|e| CacheIo::new("lock", &lock_path, e))?;
            true
        }
        Err(fs::TryLockError::Error(e)) if e.kind() == io::ErrorKind::Unsupported => false,
        Err(fs::TryLockError::Error(e)) => return Err(CacheIo::new("lock", &lock_path, e)),
    };
    Ok(KeyLock {
        _file: file,
        locked,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("deepinfer-neff-cache-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn atomic_writes_replace_and_leave_no_temporary_file() {
        let dir = temp_dir("atomic");
        write_atomic(&dir, "model.neff", b"first").unwrap();
        write_atomic(&dir, "model.neff", b"second").unwrap();
        assert_eq!(fs::read(dir.join("model.neff")).unwrap(), b"second");
        assert_eq!(names(&dir), ["model.neff"]);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_entry_round_trips_and_a_dead_writers_leftovers_are_removed() {
        let dir = temp_dir("entry");
        let entry = entry_dir(&dir, "k");
        fs::create_dir_all(&entry).unwrap();
        fs::write(entry.join(format!(".model.neff{TMP_MARK}abc")), b"junk").unwrap();
        let job = CompileJob {
            name: "g".into(),
            hlo: b"hlo".to_vec(),
        };
        let cfg = CompilerConfig {
            cache_dir: dir.clone(),
            ..CompilerConfig::default()
        };
        let meta = Meta::new(&job, "k", b"neff", "1.0", &cfg);
        write_entry(&entry, &meta, b"neff").unwrap();
        assert_eq!(names(&entry), ["meta.json", "model.neff"]);
        assert!(matches!(read_entry(&entry, "k"), Lookup::Hit(n) if n == b"neff"));
        assert!(matches!(read_entry(&entry, "other"), Lookup::Corrupt(_)));
        remove_entry(&entry).unwrap();
        assert!(matches!(read_entry(&entry, "k"), Lookup::Missing));
        let _ = fs::remove_dir_all(&dir);
    }
}
